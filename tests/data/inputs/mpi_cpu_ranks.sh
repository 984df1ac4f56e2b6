#!/bin/bash -l
#SBATCH -n 64
#SBATCH --mem-per-cpu=2000
#SBATCH -t 90
#SBATCH -J lammps-melt

module load openmpi lammps
mpirun -np $SLURM_NTASKS lmp -in in.melt
