// What the engines that set up a Buffer's windows rank by rank (shm.h, cuda_ipc.h) give each of
// this process's ranks, and what they need to know of each peer in another process.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace jax_ep {

struct EngineMember {
  int device;                   // local device ordinal
  int group;                    // EP group (a coordinate of the mesh's other axes)
  int rank;                     // position along the Buffer's axis
  uint8_t* window = nullptr;    // this rank's window, zeroed
  std::vector<uint8_t*> peers;  // every rank's window of the group as this process maps it
};

// A rank of another process whose window this process maps: where its process serves it
// (fd_socket.h) and that process's id (0: not checked, e.g. in another pid namespace).
struct EnginePeer {
  int group;
  int rank;
  std::string socket;
  int pid;
};

inline std::string rank_name(int group, int rank) {
  return "rank " + std::to_string(rank) + " of EP group " + std::to_string(group);
}

}  // namespace jax_ep
