#!/bin/bash
#SBATCH --job-name=TrainResNet     # nom du job
#SBATCH --output=TrainResNet%j.out # fichier de sortie
#SBATCH --error=TrainResNet%j.err  # fichier d'erreur
#SBATCH --constraint=v100-32g      # GPU V100 de 32 Go
#SBATCH --nodes=1                  # un noeud
#SBATCH --ntasks=4                 # quatre processus
#SBATCH --gres=gpu:4               # quatre GPU par noeud
#SBATCH --cpus-per-task=10         # 10 coeurs par processus
#SBATCH --time=01:00:00            # une heure
#SBATCH --qos=qos_gpu-dev          # QoS de developpement
#SBATCH --hint=nomultithread       # pas d'hyperthreading
#SBATCH --account=abc@v100         # comptabilite V100

module purge
module load pytorch-gpu/py3/2.1.1
set -x
srun python -u resnet_ddp.py --epochs 5
