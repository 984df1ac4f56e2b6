#!/bin/bash
#SBATCH --gres=gpu:1
#SBATCH --time=20

echo "starting at $(date)"

#SBATCH --gres=gpu:8
#SBATCH --time=2-00:00:00
python small_job.py
