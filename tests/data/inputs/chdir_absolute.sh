#!/bin/bash
#SBATCH -D /scratch/project/run1
#SBATCH -N 1
#SBATCH --ntasks-per-node=2
#SBATCH --gpus-per-node=2
#SBATCH -t 45:00

./run_pair.sh
