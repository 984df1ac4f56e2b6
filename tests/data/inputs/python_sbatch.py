#!/usr/bin/env python3
#SBATCH --ntasks=1
#SBATCH --gpus-per-task=1
#SBATCH -t 00:30:00
#SBATCH --job-name=py-inline
"""An sbatch script written in Python: sbatch reads the comments above, Python runs the rest."""
import os

print("CUDA_VISIBLE_DEVICES =", os.environ.get("CUDA_VISIBLE_DEVICES"))
