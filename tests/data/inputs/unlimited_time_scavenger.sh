#!/bin/bash
#SBATCH --time=UNLIMITED
#SBATCH --qos=scavenger
#SBATCH --gres=gpu:t4:1
#SBATCH --job-name=hparam-probe

python probe.py --trials 1000
