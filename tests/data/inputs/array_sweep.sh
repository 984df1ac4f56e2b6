#!/bin/bash
#SBATCH --array=0-9%2
#SBATCH --gres=gpu:1
#SBATCH --time=02:00:00

LR=$(python -c "print([1e-4, 3e-4, 1e-3][${SLURM_ARRAY_TASK_ID} % 3])")
python train.py --lr $LR
