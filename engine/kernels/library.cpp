// specstep's one native library: every C++ kernel in one translation unit, built once per host (`library.py`,
// cached by `engine.native` under one key) and loaded once per process, so each setting a caller pushes in (an ISA
// pin, the AMX crossovers) holds for every entry point that reads it.
//
//   kernels.cpp        the kernel layer's table: GGUF block formats x activation arithmetics x ISAs (binding.py)
//   gguf_kernel.cpp    Q4_1 / Q8_0 linears: AVX2, AVX-512, VNNI lanes and AMX tiles, and their prompt GEMM
//   cpu_attention.cpp  paged attention for decode, verify and prompts
//   decode_layers.cpp  a Llama-family decoder layer (and the whole stack) around the three above
//   argmax.cpp         greedy readout and greedy acceptance
#include "kernels.cpp"
#include "gguf_kernel.cpp"
#include "cpu_attention.cpp"
#include "decode_layers.cpp"
#include "argmax.cpp"
