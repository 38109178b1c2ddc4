// ibverbs (RDMA) transport behind the Transport seam (transport.h). Implemented in
// ibverbs_transport.cpp when libibverbs is found at build time (TF_WITH_IBVERBS), otherwise
// by no_ibverbs.cpp, whose functions report that the build has no ibverbs.
//
// Rail specs accepted in GroupOptions::rails when transport == "ibverbs":
//   * "A.B.C.D"           an IPv4 address: the device/port whose GID table holds the
//                         IPv4-mapped GID ::ffff:A.B.C.D (RoCE v2 entries preferred).
//   * "DEVICE:PORT"       e.g. "mlx5_0:1": that device and port; the GID is picked
//                         automatically (RoCE v2 IPv4-mapped first, then any RoCE v2, then the
//                         first valid entry; InfiniBand ports use the LID and GID 0).
//   * "DEVICE:PORT:GIDX"  as above with an explicit GID index.
//   * no rails            one rail: the bootstrap link's local IP if a GID matches it, else
//                         the first active port of the first device.
// Environment: TF_IBV_RING (receive/send ring bytes per rail, default 8 MiB),
// TF_IBV_TIMEOUT (RC local ACK timeout exponent, default 14 = ~67 ms, 7 retries).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "comm/transport.h"

namespace tf::comm {

struct IbvGidInfo {
  int index = 0;
  std::string gid;   // "xxxx:xxxx:...:xxxx"
  std::string type;  // "IB", "RoCEv1", "RoCEv2" or "?"
  std::string ipv4;  // set for IPv4-mapped GIDs
};

struct IbvPortInfo {
  int port = 1;
  std::string state;       // "ACTIVE", "DOWN", ...
  std::string link_layer;  // "InfiniBand" or "Ethernet"
  int active_mtu = 0;      // bytes
  int lid = 0;
  std::vector<IbvGidInfo> gids;
};

struct IbvDeviceInfo {
  std::string name;
  std::vector<IbvPortInfo> ports;
};

bool built_with_ibverbs();

// Every RDMA device visible to this process (empty when none, or when built without ibverbs).
std::vector<IbvDeviceInfo> ibverbs_devices();

// Checks, before any connection is made, that transport="ibverbs" can work with these
// options on this machine (built with ibverbs, a device exists, every rail spec resolves).
// Throws tf::Error(Unsupported / InvalidInput) naming the problem.
void ibverbs_preflight(const GroupOptions& opts);

// One RC queue pair per rail; connection details are exchanged over `boot`.
std::unique_ptr<Transport> ibverbs_transport(const GroupOptions& opts, int n_rails,
                                             Bootstrap& boot, Deadline dl);

}  // namespace tf::comm
