#!/bin/bash
#SBATCH -N 2
#SBATCH -n 8
#SBATCH --gpus-per-task=1
#SBATCH --constraint="a100|h100"
#SBATCH -t 04:00:00

python -m torch.distributed.run --nproc_per_node=1 train.py
