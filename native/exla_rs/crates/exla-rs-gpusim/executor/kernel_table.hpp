// The kernels this build of the executor can run, by the names the launcher uses. The table is
// generated with the instantiation files (kernels/generate.py, kernels/sm90/generate.py): each
// inst/*.cu defines `<kernel>_gpusim_entry(void** args)` (EXLA_RS_KERNEL_ENTRY in device.hpp),
// which unpacks cuLaunchKernel-style arguments and calls the kernel as the current CUDA thread.
#pragma once

namespace exla_rs_gpusim {

struct KernelEntry {
  const char* name;
  void (*entry)(void** args);
};

const KernelEntry* find_kernel(const char* name);

}  // namespace exla_rs_gpusim
