// The kernels of this executor build: the rows come from the generated .inc files (one per kernel
// set), each naming a `<kernel>_gpusim_entry` defined by its instantiation file.
#include <string.h>

#include "kernel_table.hpp"

#define EXLA_RS_TABLE_ROW(name) extern "C" void name##_gpusim_entry(void** args);
#include "kernel_table_mma.inc"
#include "kernel_table_sm90.inc"
#undef EXLA_RS_TABLE_ROW

namespace exla_rs_gpusim {

#define EXLA_RS_TABLE_ROW(name) {#name, name##_gpusim_entry},
static const KernelEntry kKernels[] = {
#include "kernel_table_mma.inc"
#include "kernel_table_sm90.inc"
};
#undef EXLA_RS_TABLE_ROW

const KernelEntry* find_kernel(const char* name) {
  for (const KernelEntry& k : kKernels)
    if (strcmp(k.name, name) == 0) return &k;
  return nullptr;
}

}  // namespace exla_rs_gpusim
