// Whole-range pread/pwrite: the loops every file writer and reader of zeroplus needs around the
// system calls (short transfers continued, EINTR retried, at most 1 GiB per call as Linux caps
// a transfer near 2 GiB anyway). Torch-free; errors are negative errno values.
#pragma once

#include <cstdint>

namespace zeroplus::fs {

// Writes n bytes of data at offset. 0, or -errno (-EIO when the kernel writes nothing).
int pwriteFull(int fd, const void* data, int64_t n, int64_t offset);

// Reads n bytes into data from offset. 0, -errno, or -EIO when the file ends first; *done (if
// given) gets the bytes read either way, *ended (if given) whether the file ended first (told
// apart from a read that failed with EIO).
int preadFull(int fd, void* data, int64_t n, int64_t offset, int64_t* done = nullptr, bool* ended = nullptr);

}  // namespace zeroplus::fs
