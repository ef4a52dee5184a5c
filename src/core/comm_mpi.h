// Ranks as processes: the communicator over MPI (Open MPI from Debian's libopenmpi-dev), for a model
// split over processes started by `mpirun -np N k3 ... --tp N` on one host or several (issue 23's
// multi-process start-up; CPU ranks). Collectives are MPI's own; sums run in rank order (gathered,
// then added 0..size-1) so every rank computes the same bits, as the in-process communicator does.
// Owns: MPI_Init / MPI_Finalize for the k3 process (main() calls launch() and finish()), the
// launcher's environment check. Must not: be used before launch() or after finish().
// Builds without MPI too (K3_MPI=OFF): launch() then refuses an MPI launch in one line.
#pragma once
#include <memory>
#include <string>

#include "core/comm.h"

namespace k3::mpi {

// Whether this k3 was built with MPI.
bool built();

// How many processes the launcher started (OMPI_COMM_WORLD_SIZE of Open MPI's mpirun, or PMI_SIZE
// of MPICH's and Slurm's); 1 when k3 was not started by an MPI launcher.
int launched_size();

// Under an MPI launch, each process is to see one GPU: the one of its local rank on its host
// (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID, or LOCAL_RANK for processes started
// by hand with --rank/--world/--master; else `fallback` when >= 0), taken from CUDA_VISIBLE_DEVICES
// when that is set. Sets CUDA_VISIBLE_DEVICES to it, which must happen before CUDA starts (main()
// calls it first); returns what it set ("" when no local rank is known, nothing changed).
std::string bind_local_gpu(int fallback = -1);

// When launched_size() > 1: initialises MPI (threads: serialized) and returns the communicator of
// every process of the launch (rank = the launcher's rank); null otherwise. One-line k3::Error when
// k3 was built without MPI or MPI cannot start.
std::unique_ptr<Communicator> launch(int* argc, char*** argv);

// Ends MPI after launch(): MPI_Finalize when exit_code is 0, else MPI_Abort, which ends the other
// processes too (a rank that failed must not leave the others waiting in a collective).
void finish(int exit_code);

}  // namespace k3::mpi
