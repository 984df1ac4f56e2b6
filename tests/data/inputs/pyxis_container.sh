#!/bin/bash
#SBATCH --nodes=1
#SBATCH --gpus-per-node=8
#SBATCH --container-image=nvcr.io/nvidia/pytorch:24.01-py3
#SBATCH --container-mounts=/lustre:/lustre

python /lustre/project/train.py
