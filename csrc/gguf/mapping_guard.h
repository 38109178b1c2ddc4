// SIGBUS guard for memory-mapped model files.
//
// A file that another process truncates while it is mapped makes every read of a page past
// its new end raise SIGBUS, which kills the process in the middle of a step: requests in
// flight get no answer at all. The guard turns that into an error the engine can report.
// Each mapping of a model file is registered here; when a thread faults inside one, the
// handler maps zero-filled anonymous pages over the rest of that mapping (so the faulting
// read and any later one succeed, reading zeros) and marks the mapping as lost. The engine
// checks the mark after every forward pass and raises instead of returning what it computed
// from the zeros. A SIGBUS anywhere else goes to the handler that was installed before
// (the default one terminates the process, as without the guard).
#pragma once
#include <cstddef>
#include <cstdint>

namespace tf::gguf_guard {

// Registers [base, base + size) (page-aligned, as mmap returns it) and installs the handler on
// first use. Returns a slot id for the calls below, or -1 when every slot is taken (the
// mapping then works unguarded, as before).
int register_mapping(const void* base, size_t size);
// Forgets a slot; call before munmap.
void unregister_mapping(int slot);
// Whether a read inside the slot's mapping faulted (the bytes read since were zeros).
bool mapping_lost(int slot);
// Pages of lost mappings replaced so far, over all mappings (for tests and statistics).
uint64_t faults_handled();

}  // namespace tf::gguf_guard
