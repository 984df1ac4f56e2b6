#!/bin/sh
#SBATCH --time 4320
#SBATCH --account ml-team
#SBATCH --gpus 2
#SBATCH --job-name "long eval"

python evaluate.py --checkpoints ckpt/ --gpus 2
