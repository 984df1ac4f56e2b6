#!/bin/bash
#SBATCH --job-name=llama-8b-ft
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=32
#SBATCH --time=30

echo "node rank ${NODE_RANK:-?} of ${WORLD_SIZE:-?} on $(hostname)"
