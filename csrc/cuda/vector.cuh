// N values of T as one aligned access: a reinterpret_cast of a suitably
// aligned pointer to Vector<T, N>* loads or stores them in one instruction
// (up to 16 bytes; a 32-byte vector takes two).
#pragma once

namespace linnet {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vector {
  T values[N];
};

}  // namespace linnet
