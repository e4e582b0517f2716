// What every rank of an op tells the others about the op besides its rows (host and device,
// both backends): the op's signature, sent in each count record, and the abort record a rank
// that gives up writes into every window of its group. docs/ARCHITECTURE.md has the protocol.
//
// A receiver compares every source's signature with its own (the record it sent itself): ranks
// that run different ops at one op number never decode each other's rows, they stop and name
// both ops.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>

#include "kernels/dtype.h"

namespace jax_ep {

// The kinds of op on the wire (a whole op and its halves are the same kind).
enum class OpKind : uint32_t {
  kDispatch = 1,         // fresh: rows, expert ids and weights, rows per expert
  kDispatchCached = 2,   // a handle's routes: rows only
  kCombine = 3,          // rows back to their tokens
  kDispatchAdjoint = 4,  // a combine with float32 extra columns (the weights' cotangents)
};

// The call as its sender saw it: what decides how its rows are laid out and read.
struct Signature {
  OpKind kind;
  bool fp8, round_scale;
  Dtype dtype;      // dispatch: x's type (fp8: what was quantised); combine: the rows' type
  int32_t width;    // dispatch: hidden; combine: the rows' width
  int32_t columns;  // dispatch: top-k (fresh) or 0; adjoint: extra float32 columns; else 0
  int32_t tokens;   // dispatch: tokens per rank; combine: rank-level rows sent back
  int32_t experts;  // experts of the Buffer
  uint32_t site;    // where the program calls the op (jax_ep/ffi_path.py, call_site), or 0
};

// Three words: kind | fp8 | round_scale | dtype | columns (16 bits) | experts (32 bits); width |
// tokens; the call site.
constexpr int kSignatureWords = 3;
JAX_EP_HD void signature_words(const Signature& s, uint64_t* w) {
  w[0] = uint64_t(uint32_t(s.kind) & 0xff) | uint64_t(s.fp8) << 8 | uint64_t(s.round_scale) << 9 |
         uint64_t(uint32_t(s.dtype) & 3) << 10 | uint64_t(uint32_t(s.columns) & 0xffff) << 16 |
         uint64_t(uint32_t(s.experts)) << 32;
  w[1] = uint64_t(uint32_t(s.width)) | uint64_t(uint32_t(s.tokens)) << 32;
  w[2] = s.site;
}
JAX_EP_HD Signature signature_of(const uint64_t* w) {
  Signature s;
  s.kind = OpKind(uint32_t(w[0] & 0xff));
  s.fp8 = (w[0] >> 8) & 1;
  s.round_scale = (w[0] >> 9) & 1;
  s.dtype = Dtype(int32_t((w[0] >> 10) & 3));
  s.columns = int32_t((w[0] >> 16) & 0xffff);
  s.experts = int32_t(uint32_t(w[0] >> 32));
  s.width = int32_t(uint32_t(w[1]));
  s.tokens = int32_t(uint32_t(w[1] >> 32));
  s.site = uint32_t(w[2]);
  return s;
}

// Why a rank gave up (the codes of its abort record).
enum Wait : int32_t {
  kWaitRows = 1,     // a source's rows (their flags)
  kWaitCounts = 2,   // a source's count record
  kWaitRelease = 3,  // a destination to release the slot
  kWaitLower = 4,    // the counts of the ranks before this one (rows it writes in place)
  kMismatch = 5,     // a source ran another op (its signature differs from this rank's)
  kPeerEnded = 6,    // the peer's process has ended (jax_ep/liveness.py's watch)
  kNodesDiffer = 7,  // over a tuple axis, node `peer` ran another op than node `giver`
};

// The abort record, in every window of a group: the first rank to give up claims each window's
// record (state 0 -> 1), writes it, then publishes it (state 2, a release). Every wait of a rank
// checks its own window's state, so one rank's failure stops every peer at once.
struct AbortRecord {
  uint64_t code;                   // a Wait
  uint64_t giver;                  // the rank that gave up
  uint64_t peer;                   // the rank it waited for, or whose op differed
  uint64_t op;                     // the op it gave up in
  uint64_t mine[kSignatureWords];  // kMismatch: the giver's signature and the peer's
  uint64_t theirs[kSignatureWords];
};
enum AbortState : uint64_t { kNoAbort = 0, kAbortClaimed = 1, kAbortWritten = 2 };

// Host only (the messages of errors).
inline const char* dtype_name(Dtype t) {
  return t == Dtype::kF32 ? "float32" : t == Dtype::kBF16 ? "bfloat16" : "float8_e4m3fn";
}

// A readable op, e.g. "dispatch(fp8 rows of bfloat16 x, hidden 256, 16 tokens, top-4 of 16
// experts)".
inline std::string describe(const Signature& s) {
  const std::string w = std::to_string(s.width), n = std::to_string(s.tokens);
  const std::string experts = " of " + std::to_string(s.experts) + " experts";
  switch (s.kind) {
    case OpKind::kDispatch:
    case OpKind::kDispatchCached: {
      std::string rows = s.fp8 ? std::string("fp8") + (s.round_scale ? " (round_scale)" : "") +
                                     " rows of " + dtype_name(s.dtype) + " x"
                               : std::string(dtype_name(s.dtype)) + " rows";
      const std::string topk = s.kind == OpKind::kDispatch
                                   ? ", top-" + std::to_string(s.columns) + experts
                                   : ", a handle's routes";
      return std::string(s.kind == OpKind::kDispatch ? "dispatch(" : "cached dispatch(") + rows +
             ", hidden " + w + ", " + n + " tokens" + topk + ")";
    }
    case OpKind::kCombine:
      return "combine(" + std::string(dtype_name(s.dtype)) + " rows, width " + w + ", " + n +
             " rows)";
    case OpKind::kDispatchAdjoint:
      return "dispatch adjoint(" + std::string(dtype_name(s.dtype)) + " rows, width " + w + ", " +
             std::to_string(s.columns) + " weight columns, " + n + " rows)";
  }
  return "an unknown op (kind " + std::to_string(uint32_t(s.kind)) + ")";
}

inline const char* what_waited(int64_t code) {
  switch (code) {
    case kWaitRows:
      return "its rows";
    case kWaitCounts:
      return "its row counts";
    case kWaitRelease:  // it has not received an earlier op of this rank's
      return "it to release the window: it has not received an earlier op (a *_send whose "
             "*_recv never ran?)";
    case kWaitLower:
      return "its row counts (rows placed after its)";
  }
  return "it";
}

// "call site 1a2b3c4d" (host only).
inline std::string describe_site(uint32_t site) {
  char hex[9];
  std::snprintf(hex, sizeof hex, "%08x", site);
  return std::string("call site ") + hex;
}

// The error of a stopped rank (`observer`) from its window's abort record.
inline std::string abort_message(const AbortRecord& a, int group, int observer, double timeout_s) {
  std::string m = "jax_ep: ";
  const std::string g = " of EP group " + std::to_string(group);
  if (a.code == kMismatch) {
    const Signature mine = signature_of(a.mine), theirs = signature_of(a.theirs);
    m += "rank " + std::to_string(a.peer) + " ran " + describe(theirs) + " while rank " +
         std::to_string(a.giver) + " ran " + describe(mine) + " at op " + std::to_string(a.op) + g;
    if (mine.site != theirs.site)  // alike ops from two places: a rank skipped one?
      m += " (called from " + describe_site(theirs.site) + " and from " + describe_site(mine.site) +
           ")";
    m += ": every rank of a Buffer must run the same jax_ep ops, called from the same places, in "
         "the same order.";
  } else if (a.code == kNodesDiffer) {  // giver and peer are nodes (jax_ep/node_check.py)
    const Signature mine = signature_of(a.mine), theirs = signature_of(a.theirs);
    m += "node " + std::to_string(a.peer) + " ran " + describe(theirs) + " while node " +
         std::to_string(a.giver) + " ran " + describe(mine) + " over the node axes";
    if (mine.site != theirs.site)
      m += " (called from " + describe_site(theirs.site) + " and from " + describe_site(mine.site) +
           ")";
    m += ": every node of a Buffer must run the same jax_ep ops, called from the same places, in "
         "the same order.";
  } else if (a.code == kPeerEnded) {
    m += "rank " + std::to_string(a.giver) + g + " stopped waiting for rank " +
         std::to_string(a.peer) + " (op " + std::to_string(a.op) + "): the process of rank " +
         std::to_string(a.peer) +
         " has ended (its liveness connection closed; Buffer.status() names the process).";
  } else {
    m += "rank " + std::to_string(a.giver) + g + " waited more than " + std::to_string(timeout_s) +
         " s for rank " + std::to_string(a.peer) + " (" + what_waited(int64_t(a.code)) + ", op " +
         std::to_string(a.op) +
         "): every rank of the group must run the same jax_ep ops; did a process stop?";
  }
  if (a.code != kNodesDiffer && uint64_t(observer) != a.giver)  // a node's giver is no rank
    m += " (Rank " + std::to_string(observer) + " stopped at once: rank " +
         std::to_string(a.giver) + " wrote the abort into its window.)";
  return m +
         " The op's results are NaN (integers -1, counts 0); this Buffer stopped: create "
         "a new one.";
}

}  // namespace jax_ep
