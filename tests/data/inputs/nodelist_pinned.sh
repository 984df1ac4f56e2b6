#!/bin/bash
#SBATCH -w gpu-node07
#SBATCH --gres=gpu:2
#SBATCH -t 60

python benchmark_nccl.py
