/* The head sizes the attention kernels compile apart (D a constant: loops unrolled, a head's vectors kept in
 * registers), shared by paged_decode_attention.c and paged_prefill_attention.c; any other size takes the generic
 * code. CALL(D) is a macro that runs the kernel's body for head size D. */
#ifndef FLOTILLA_HEAD_DIMS_H
#define FLOTILLA_HEAD_DIMS_H

#define FLOTILLA_FOR_HEAD_DIM(head_dim, CALL) \
    switch (head_dim) {                       \
        case 32: CALL(32); break;             \
        case 64: CALL(64); break;             \
        case 128: CALL(128); break;           \
        default: CALL(head_dim);              \
    }

#endif
