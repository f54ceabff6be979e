/* dequant: out = f32(q) * s, rounded once to out's dtype; one work-item per element
 * (grid-stride). */
__kernel void mf_dequant(__global const uchar *q, long qo, long qs0, int qdt,
                         __global const uchar *sc, long sco, long scs, int scdt,
                         int layout, __global uchar *out, long oo, long os0, int odt, long rows,
                         long hidden, long group)
{
    const long total = rows * hidden;
    for (long i = (long)get_global_id(0); i < total; i += (long)get_global_size(0)) {
        const long t = i / hidden, c = i % hidden, g = c / group;
        float s;
        if (layout == MF_PACKED) {
            s = mf_ue8m0_read(sc[(sco + (g / 4) * scs + t) * 4 + (g % 4)]);
        } else {
            long idx = sco + (layout == MF_COLUMN_MAJOR ? g * scs + t : t * scs + g);
            s = scdt == MF_F32 ? ((__global const float *)sc)[idx] : mf_ue8m0_read(sc[idx]);
        }
        const uchar b = q[qo + t * qs0 + c];
        const float v = qdt == MF_F8 ? mf_e4m3_to_f32(b) : (float)(char)b;
        mf_store(out, odt, oo + t * os0 + c, mf_mul(v, s)); /* the NaN code's bits, as on x86 */
    }
}
