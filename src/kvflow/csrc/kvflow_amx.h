// AMX tile setup shared by kvflow's CPU kernels that multiply on tiles (attention/csrc/
// prompt_attention_cpu.cpp, quant/csrc/panel_linear_cpu.cpp). Included only where the compiler
// targets AMX (the includer checks __AMX_TILE__ and __AMX_BF16__) on Linux. A change here names new
// builds of every kernel (cpu_extension.build_name hashes this folder's headers).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace kvflow_amx {

// Linux hands out the tile registers only to a process that asked.
inline bool permitted() {
  static const bool granted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 as 16 rows of 64 bytes, for this thread.
inline void configure_full_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

}  // namespace kvflow_amx
