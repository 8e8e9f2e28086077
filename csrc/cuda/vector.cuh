// N values of T as one aligned access: a reinterpret_cast of a suitably
// aligned pointer to Vector<T, N>* loads or stores them in one instruction
// (up to 16 bytes; a 32-byte vector takes two).
#pragma once

#include <cstddef>
#include <cstdint>

namespace linnet {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vector {
  T values[N];
};

// Whether `pointer` may be read as Vectors of `bytes` bytes.
inline bool aligned(const void* pointer, size_t bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % bytes == 0;
}

}  // namespace linnet
