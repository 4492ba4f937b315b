"""The webgpu backend: WGSL compute shaders through wgpu (Vulkan, Metal, DX12)."""
