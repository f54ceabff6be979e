/*
 * First in the embedded program, ahead of the shared headers: OpenCL C
 * contracts a * b + c into an fma by default, and NUMERICS.md fuses nothing
 * unless it says fmaf (mf_portable.h sets the same; this keeps it first
 * whatever the header does).
 */
#pragma OPENCL FP_CONTRACT OFF
