// CUDA build of the Paddle ops: the same single translation unit, compiled by nvcc so
// the copy kernel and launchers are included (setup_ops.py picks this file when Paddle
// is compiled with CUDA).
#include "fdkv_paddle_ops.cc"
