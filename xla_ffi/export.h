// FT_JAX_EXPORT: the one way ft_jax marks a symbol exported from the shared library (handler symbols, state type
// hooks, the host bank C API), for the ctypes / jax.ffi.pycapsule users of the Bazel-built library. C compatible.
#ifndef FT_JAX_XLA_FFI_EXPORT_H_
#define FT_JAX_XLA_FFI_EXPORT_H_

#if defined(_WIN32)
#define FT_JAX_EXPORT __declspec(dllexport)
#else
#define FT_JAX_EXPORT __attribute__((visibility("default")))
#endif

// Declares an XLA FFI handler symbol (defined by XLA_FFI_DEFINE_HANDLER_SYMBOL) as exported.
#define FT_JAX_DECLARE_HANDLER(fn) extern "C" FT_JAX_EXPORT XLA_FFI_Error* fn(XLA_FFI_CallFrame* call_frame)

#endif  // FT_JAX_XLA_FFI_EXPORT_H_
