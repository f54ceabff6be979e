/*
 * The CPU reference conversions (src/cpu/numerics.h) under other names, for
 * check_numerics.c, which includes the CUDA backend's numerics.cuh (same
 * function names) in its own translation unit.
 */
#include "cpu/numerics.h"

uint32_t ref_f32_to_bf16(float f) { return mf_f32_to_bf16(f); }
uint32_t ref_f32_to_f16(float f) { return mf_f32_to_f16(f); }
float ref_f16_to_f32(uint16_t h) { return mf_f16_to_f32(h); }
uint32_t ref_f32_to_e4m3(float f) { return mf_f32_to_e4m3(f); }
float ref_e4m3_to_f32(uint8_t b) { return mf_e4m3_to_f32(b); }
uint32_t ref_f32_to_i8(float f) { return (uint8_t)mf_f32_to_i8(f); }
uint32_t ref_ue8m0_exponent(float s) { return mf_ue8m0_exponent(s); }
