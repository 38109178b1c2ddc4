// Process group for tensor parallelism across machines: rank/size, in-place All-Reduce
// (sum), broadcast and barrier over one or more "rails" (independent links). Transports
// (TCP multi-rail, ibverbs dual-rail) sit under one interface; the All-Reduce algorithm
// (chunking, striping, ordering, rail fail-over) is shared. Every wait has a timeout: a lost
// peer is a tf::Error within the timeout, never a hang. Rank 0 admits only a peer that
// passes the handshake (protocol, configuration, optional token); anything else that
// connects is logged to stderr (rate-limited, never silenced) and dropped while rank 0 keeps
// listening until its timeout. Candidates are handshaken concurrently, so connections that
// stay silent cannot hold the real peer out.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace tf::comm {

enum class DType { F32, F16, BF16 };

struct GroupOptions {
  int rank = 0;
  int size = 1;
  // Bootstrap address "HOST:PORT": rank 0 listens there, the other rank connects to it.
  std::string addr;
  // One local address (IP of the interface) per rail; empty = one rail on the default route.
  // Rank 0 listens on each of its rail addresses, the peer connects from its own.
  std::vector<std::string> rails;
  double timeout_s = 30.0;
  // The listening rank's wait for its peer to connect (seconds; 0: until interrupted, as a TP
  // worker started long before rank 0 waits; < 0: timeout_s). Every other wait uses timeout_s.
  double wait_s = -1;
  std::string transport = "tcp";  // "tcp" or "ibverbs"
  // Refused at connect unless both ranks give the same value (model hash, TP size, formats).
  std::string handshake;
  // How a handshake mismatch is explained without the comm layer knowing what the text means:
  // when both texts are the same space-separated items and only the values of KEY=VALUE items
  // differ, each such item is named (label, else KEY) with both values, followed by the fixes
  // ("start both ranks with " + the distinct fixes joined by " and ").
  struct HandshakeHint {
    std::string label;  // "context"
    std::string fix;    // "the same -c/--context"
  };
  std::map<std::string, HandshakeHint> handshake_hints;
  // How messages name this rank and its peer. The comm ranks follow the setup (rank 0 listens),
  // which need not be how the user knows them (a TP worker listens). Empty: "rank N".
  std::string self_name, peer_name;
  // Optional shared secret. When set, each rank proves it knows it (HMAC-SHA256 over both
  // ranks' fresh nonces; the token itself never crosses the wire) and refuses a peer that
  // cannot. Both ranks must give the same token, or both none.
  std::string token;
  // Messages up to small_bytes take the one-shot latency path; larger ones are cut into
  // chunk_bytes pieces striped over the rails. Rank 0's values are used by both ranks.
  size_t small_bytes = size_t(64) << 10;
  size_t chunk_bytes = size_t(512) << 10;
};

struct RailStats {
  std::string local, peer;
  bool up = true;
  uint64_t bytes_sent = 0, bytes_received = 0;
  double throughput_mb_s = 0;  // measured estimate used for striping
  std::string down_reason;     // why the rail went down (empty while up)
};

struct GroupStats {
  uint64_t all_reduces = 0, broadcasts = 0, barriers = 0;
  uint64_t small_messages = 0;   // took the one-shot latency path
  uint64_t rail_failures = 0;    // rails lost and traffic moved to the others
  double seconds_in_collectives = 0;
  std::vector<RailStats> rails;
};

class Group {
 public:
  static std::unique_ptr<Group> create(const GroupOptions& opts);
  virtual ~Group() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In-place sum over all ranks. Every rank ends with bit-identical results (the sum is
  // taken in rank order everywhere).
  virtual void all_reduce(void* data, size_t count, DType dtype) = 0;
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
  virtual void barrier() = 0;
  virtual GroupStats stats() const = 0;
  // broadcast() on a receiving rank that idles until the root starts the collective: until
  // the first byte arrives it waits in slices of <= 50 ms and calls tf::check_interrupt(), so
  // Ctrl-C ends the wait (Interrupted; the group is unusable afterwards). Once data arrives
  // it completes exactly like broadcast(); the usual timeout applies throughout.
  virtual void broadcast_idle(void* data, size_t bytes, int root) = 0;
  // Test hook: take `rail` down (shut its link) during the next collective, once this rank
  // has sent at least `after_bytes` on that rail in it. Groups without rails refuse.
  virtual void debug_fail_rail(int rail, uint64_t after_bytes);
};

}  // namespace tf::comm
