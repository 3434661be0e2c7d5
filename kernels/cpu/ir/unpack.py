"""Unpackers of K-quant super-blocks to unsigned codes, one per byte (unpack_q2_k .. unpack_q6_k),
for the prompt tiles (tiles.sbdot_tile, tiles.tile8_row): 32-byte vector steps.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from edgellm.kernels.cpu.ir.builder import array_ptr, const, i8, load_vec

# --- unpacking K-quant super-blocks for the tiled product (ktiled._unpack_sb) ----------------
def unpack_codes_kind(kind):
    """unpack_q<kind>_k(row, o, wq, w0): the 256 codes of the Q<kind>_K super-block at byte o of row as
    unsigned bytes wq[w0 + i] (weight i, code = q + offset: see ktiled._unpack_sb), as 32-byte
    vector steps."""
    @intrinsic
    def unpack(typingctx, row, o, wq, w0):
        sig = types.void(row, types.uint64, wq, types.uint64)

        def codegen(context, builder, signature, args):
            row_, o_, wq_, w0_ = args
            rp = array_ptr(context, builder, signature.args[0], row_)
            wp = array_ptr(context, builder, signature.args[2], wq_)

            def at(off):
                return load_vec(builder, rp, builder.add(o_, const(off)), i8(32))

            def bits(v, shift, mask):
                if shift:
                    v = builder.lshr(v, ir.Constant(i8(32), [shift] * 32))
                return builder.and_(v, ir.Constant(i8(32), [mask] * 32))

            def put(i, v):
                ptr = builder.bitcast(builder.gep(wp, [builder.add(w0_, const(32 * i))]), i8(32).as_pointer())
                builder.store(v, ptr, align=1)

            def shl(v, n):
                return builder.shl(v, ir.Constant(i8(32), [n] * 32))

            if kind == 2:  # qs at 16
                for c in range(2):
                    q = at(16 + 32 * c)
                    for s in range(4):
                        put(4 * c + s, bits(q, 2 * s, 3))
            elif kind == 3:  # hmask at 0, qs at 32
                hm = at(0)
                for c in range(2):
                    q = at(32 + 32 * c)
                    for s in range(4):
                        put(4 * c + s, builder.or_(bits(q, 2 * s, 3), shl(bits(hm, 4 * c + s, 1), 2)))
            elif kind in (4, 5):  # (Q5_K: qh at 16) qs at 16 / 48
                qs = 16 if kind == 4 else 48
                qh = at(16) if kind == 5 else None
                for c in range(4):
                    q = at(qs + 32 * c)
                    for n in range(2):
                        b = 2 * c + n
                        v = bits(q, 4 * n, 15)
                        if kind == 5:
                            v = builder.or_(v, shl(bits(qh, b, 1), 4))
                        put(b, v)
            else:  # Q6_K: ql at 0, qh at 128
                for h in range(2):
                    qh = at(128 + 32 * h)
                    for t in range(4):
                        lo = bits(at(64 * h + 32 * (t & 1)), 4 * (t >> 1), 15)
                        put(4 * h + t, builder.or_(lo, shl(bits(qh, 2 * t, 3), 4)))
            return context.get_dummy_value()

        return sig, codegen

    return unpack


unpack_q2_k, unpack_q3_k, unpack_q4_k, unpack_q5_k, unpack_q6_k = (unpack_codes_kind(k) for k in (2, 3, 4, 5, 6))
