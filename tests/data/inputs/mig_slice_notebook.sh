#!/bin/bash
#SBATCH --gres=gpu:1g.10gb:1
#SBATCH -t 8:00:00
#SBATCH --qos=low
#SBATCH --job-name=jupyter

jupyter lab --no-browser --ip=0.0.0.0 --port=8888
