// Processes of the mesh that have ended, as the liveness watch finds them (jax_ep/liveness.py
// connects to each watched process's liveness listener and hands the connection over). A thread
// of this module, not Python's, holds the connections, so a peer's end takes effect without
// waiting for the interpreter's lock: where the coordination service's process ends, JAX
// terminates this one within milliseconds, and the message should be out by then. A connection
// that closes without the listener's goodbye byte means that its process has ended: the message
// given for the process goes to stderr, and every rank of a live Buffer with a peer there is
// told (NativeBuffer::peer_ended: its waits for that peer give up at once, the op's results are
// NaN).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "ffi/buffers.h"

namespace jax_ep {

// What a liveness listener sends the connections it holds when it closes: its process goes on
// without a Buffer (the watch ends), or its interpreter exits (the process has ended; nothing is
// said). A connection closed without either means that the process was killed or crashed.
constexpr char kGoodbye = '-';
constexpr char kExiting = 'x';

// Tells `buffer` of every process among rank_processes (per group, per rank: the process holding
// it) that has ended, and of those that end later while the Buffer lives.
void watch_buffer(std::shared_ptr<NativeBuffer> buffer,
                  std::vector<std::vector<int>> rank_processes);

// Watches `process` through `fd`, a socket connected to its liveness listener (owned from here
// on; closed at once where the process is watched already); when it is killed or crashes,
// `message` goes to stderr.
void watch_process(int process, int fd, std::string message);

// The processes found ended so far.
std::vector<int> ended_processes();

// Closes every watch connection (the processes found ended stay so).
void stop_watching();

}  // namespace jax_ep
