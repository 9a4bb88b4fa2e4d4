//! Host (CPU) flash attention. Written by the host-kernel work; see the module docs there.
