#!/bin/bash
#SBATCH --ntasks=24
#SBATCH --gres=gpu:4
#SBATCH --time=10:00:00

srun ./md_engine -input system.tpr
