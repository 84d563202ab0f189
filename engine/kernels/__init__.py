"""specstep's CPU kernel layer: C++ sources (kernels.cpp, formats.h, quantize.h, linear.inc) behind one binding
(`binding`)."""
