#!/bin/bash
#SBATCH -A m1234_g
#SBATCH -C gpu
#SBATCH -q regular
#SBATCH -t 6:00:00
#SBATCH -N 4
#SBATCH --ntasks-per-node=4
#SBATCH -c 32
#SBATCH --gpus-per-task=1
#SBATCH --gpus-per-node=4
#SBATCH --gpu-bind=none

export SLURM_CPU_BIND="cores"
export OMP_NUM_THREADS=8
export MASTER_ADDR=$(scontrol show hostnames $SLURM_NODELIST | head -n 1)

srun python -u train_cosmo.py --config configs/cosmo_4node.yaml
