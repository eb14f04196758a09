/* quants_tool.c — duet's block formats on raw files, for the Python
 * reference check (tests/test_quants_reference.py) and the RMSE table.
 *
 *   quants_tool dequant TYPE IN OUT   raw blocks of TYPE -> f32
 *   quants_tool quant TYPE IN OUT     f32 -> raw blocks of TYPE
 *   quants_tool rmse [ROWS]           RMSE of every type on Gaussian rows
 *
 * TYPE is a duet type name ("q4_k", "iq4_nl", ...). Built only with the
 * tests; not part of the CLI. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

static int type_of(const char *name, duet_dtype *t) {
    for (int i = 0; i < 64; i++) {
        const char *n = duet_dtype_name((duet_dtype)i);
        if (n && !strcmp(n, name)) {
            *t = (duet_dtype)i;
            return 1;
        }
    }
    fprintf(stderr, "quants_tool: unknown type '%s'\n", name);
    return 0;
}

static void *read_all(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *buf = malloc(n > 0 ? (size_t)n : 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    *size = (size_t)n;
    return buf;
}

static int write_all(const char *path, const void *buf, size_t size) {
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    int ok = fwrite(buf, 1, size, f) == size;
    return fclose(f) == 0 && ok;
}

/* dequant (to_f32) or quant (from f32), whole file as one row. */
static int convert(int to_f32, const char *type, const char *in, const char *out) {
    duet_dtype t;
    if (!type_of(type, &t)) return 2;
    size_t size, bb = duet_dtype_block_bytes(t);
    int blk = duet_dtype_block(t);
    void *src = read_all(in, &size);
    size_t unit = to_f32 ? bb : (size_t)blk * sizeof(float);
    if (!src || size % unit) {
        fprintf(stderr, "quants_tool: cannot read %s as whole %s blocks\n", in, type);
        free(src);
        return 1;
    }
    int64_t n = (int64_t)(size / unit) * blk;
    size_t out_size = to_f32 ? (size_t)n * sizeof(float) : (size_t)(n / blk) * bb;
    void *dst = malloc(out_size ? out_size : 1);
    if (to_f32)
        duet_dequantize_row(t, src, dst, n);
    else
        duet_convert_row(t, src, dst, n);
    int ok = write_all(out, dst, out_size);
    free(src);
    free(dst);
    return ok ? 0 : 1;
}

/* Box-Muller over a fixed LCG: the same rows on every machine. */
static double gauss(unsigned long long *s) {
    double u[2];
    for (int i = 0; i < 2; i++) {
        *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
        u[i] = ((double)(*s >> 11) + 0.5) / 9007199254740992.0;
    }
    return sqrt(-2 * log(u[0])) * cos(6.283185307179586 * u[1]);
}

static int rmse(int rows) {
    static const duet_dtype types[] = {DUET_DTYPE_Q4_0, DUET_DTYPE_Q4_1, DUET_DTYPE_Q5_0,   DUET_DTYPE_Q5_1,
                                       DUET_DTYPE_Q8_0, DUET_DTYPE_Q2_K, DUET_DTYPE_Q3_K,   DUET_DTYPE_Q4_K,
                                       DUET_DTYPE_Q5_K, DUET_DTYPE_Q6_K, DUET_DTYPE_IQ4_NL, DUET_DTYPE_IQ4_XS,
                                       DUET_DTYPE_Q8_K};
    const int n = 4096;
    float *x = malloc(sizeof(float) * n), *y = malloc(sizeof(float) * n);
    void *q = malloc(duet_dtype_row_bytes(DUET_DTYPE_F32, n));
    printf("type     bits/w  rmse (unit Gaussian, %d rows of %d)\n", rows, n);
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        duet_dtype t = types[ti];
        unsigned long long s = 1234;
        double se = 0;
        for (int r = 0; r < rows; r++) {
            for (int i = 0; i < n; i++)
                x[i] = (float)gauss(&s);
            duet_convert_row(t, x, q, n);
            duet_dequantize_row(t, q, y, n);
            for (int i = 0; i < n; i++)
                se += ((double)y[i] - x[i]) * ((double)y[i] - x[i]);
        }
        printf("%-8s %6.3f  %.6f\n", duet_dtype_name(t),
               8.0 * (double)duet_dtype_block_bytes(t) / duet_dtype_block(t), sqrt(se / ((double)rows * n)));
    }
    free(x);
    free(y);
    free(q);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 5 && !strcmp(argv[1], "dequant")) return convert(1, argv[2], argv[3], argv[4]);
    if (argc == 5 && !strcmp(argv[1], "quant")) return convert(0, argv[2], argv[3], argv[4]);
    if (argc >= 2 && !strcmp(argv[1], "rmse")) return rmse(argc > 2 ? atoi(argv[2]) : 64);
    fprintf(stderr, "usage: quants_tool dequant|quant TYPE IN OUT | rmse [ROWS]\n");
    return 2;
}
