/* The split of 2-byte values into their byte planes that split-zstd chunks store
 * (hsstore.codec.codecs): low[i] = in[2i], high[i] = in[2i + 1]. Shared by the encoder's
 * split (`_split_decoder.split_planes`) and the writer's pass that splits rows as it copies
 * them into its shard buffer (`_xxh3_many.copy_rows`).
 *
 * ``low`` may be ``in`` itself: every store lands at or before the bytes already loaded, so a
 * forward pass reads each value before it is overwritten. */
#ifndef HSSTORE_BYTE_PLANES_H
#define HSSTORE_BYTE_PLANES_H

#include <stddef.h>
#include <stdint.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static inline void split_bytes(uint8_t *low, uint8_t *high, const uint8_t *in, size_t n) {
    size_t i = 0;
#if defined(__SSE2__)
    const __m128i low_byte = _mm_set1_epi16(0x00FF);
    for (; i + 16 <= n; i += 16) {
        __m128i a = _mm_loadu_si128((const __m128i *)(in + 2 * i));
        __m128i b = _mm_loadu_si128((const __m128i *)(in + 2 * i + 16));
        __m128i lo = _mm_packus_epi16(_mm_and_si128(a, low_byte), _mm_and_si128(b, low_byte));
        __m128i hi = _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8));
        _mm_storeu_si128((__m128i *)(low + i), lo);
        _mm_storeu_si128((__m128i *)(high + i), hi);
    }
#endif
    for (; i < n; i++) {
        uint8_t lo = in[2 * i], hi = in[2 * i + 1];
        low[i] = lo;
        high[i] = hi;
    }
}

/* The same, writing around the caches where both planes are 16-byte aligned (else as
 * split_bytes): for planes not read again before they have left the caches anyway. The caller
 * orders the stores (_mm_sfence) before another thread reads the planes. */
static inline void split_bytes_streamed(uint8_t *low, uint8_t *high, const uint8_t *in, size_t n) {
#if defined(__SSE2__)
    if ((((uintptr_t)low | (uintptr_t)high) & 15) == 0) {
        size_t i = 0;
        const __m128i low_byte = _mm_set1_epi16(0x00FF);
        for (; i + 16 <= n; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(in + 2 * i));
            __m128i b = _mm_loadu_si128((const __m128i *)(in + 2 * i + 16));
            _mm_stream_si128((__m128i *)(low + i),
                             _mm_packus_epi16(_mm_and_si128(a, low_byte),
                                              _mm_and_si128(b, low_byte)));
            _mm_stream_si128((__m128i *)(high + i),
                             _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
        }
        split_bytes(low + i, high + i, in + 2 * i, n - i);
        return;
    }
#endif
    split_bytes(low, high, in, n);
}

#endif
