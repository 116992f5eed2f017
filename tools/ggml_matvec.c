// One-input matvec of ggml's CPU backend, timed: y = W x with W (ROWS x COLS, ggml type TYPE,
// raw blocks read from FILE) and x (COLS floats), through ggml_mul_mat on a threadpool of THREADS.
// W is copied until the copies hold STREAM_BYTES and the passes cycle through them, so every pass
// reads its weights from memory, not from the cache (as hybrid.kernel_bench does for ours).
// Prints one line: "<median seconds> <passes>". Built and run by tools/vs_ggml_cpu.py.
//
//   ggml_matvec TYPE ROWS COLS THREADS FILE STREAM_BYTES MIN_SECONDS
#include "ggml.h"
#include "ggml-cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define MAX_COPIES 256
#define MAX_PASSES 100000

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int fail(const char *what) {
    fprintf(stderr, "ggml_matvec: %s\n", what);
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 8) return fail("usage: TYPE ROWS COLS THREADS FILE STREAM_BYTES MIN_SECONDS");
    enum ggml_type type = GGML_TYPE_COUNT;
    for (int i = 0; i < GGML_TYPE_COUNT; i++) {
        const char *name = ggml_type_name((enum ggml_type)i);
        if (name && strcasecmp(name, argv[1]) == 0) type = (enum ggml_type)i;
    }
    if (type == GGML_TYPE_COUNT) return fail("unknown type");
    const int64_t rows = atoll(argv[2]), cols = atoll(argv[3]);
    const int threads = atoi(argv[4]);
    const double stream_bytes = atof(argv[6]), min_seconds = atof(argv[7]);
    const size_t weight_bytes = (size_t)rows * ggml_row_size(type, cols);
    int copies = (int)(stream_bytes / weight_bytes) + 1;
    if (copies < 2) copies = 2;
    if (copies > MAX_COPIES) copies = MAX_COPIES;

    struct ggml_init_params params = {
        .mem_size = copies * (weight_bytes + ggml_graph_overhead() + 4096) + cols * sizeof(float) + (16 << 20),
        .mem_buffer = NULL,
        .no_alloc = false,
    };
    struct ggml_context *ctx = ggml_init(params);
    if (!ctx) return fail("out of memory");
    struct ggml_tensor *x = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, cols);
    float *xs = (float *)x->data;
    unsigned seed = 1;
    for (int64_t i = 0; i < cols; i++) {
        seed = seed * 1103515245u + 12345u;
        xs[i] = ((seed >> 8) & 0xFFFF) / 32768.0f - 1.0f;
    }
    FILE *f = fopen(argv[5], "rb");
    if (!f) return fail("cannot open the weights file");
    struct ggml_cgraph *graphs[MAX_COPIES];
    struct ggml_tensor *first = NULL;
    for (int c = 0; c < copies; c++) {
        struct ggml_tensor *w = ggml_new_tensor_2d(ctx, type, cols, rows);
        if (c == 0) {
            if (fread(w->data, 1, weight_bytes, f) != weight_bytes) return fail("weights file too short");
            first = w;
        } else {
            memcpy(w->data, first->data, weight_bytes);
        }
        graphs[c] = ggml_new_graph(ctx);
        ggml_build_forward_expand(graphs[c], ggml_mul_mat(ctx, w, x));
    }
    fclose(f);

    struct ggml_threadpool_params pool_params = ggml_threadpool_params_default(threads);
    struct ggml_threadpool *pool = ggml_threadpool_new(&pool_params);
    struct ggml_cplan plan = ggml_graph_plan(graphs[0], threads, pool);
    void *work = malloc(plan.work_size + 64);
    for (int c = 0; c < copies; c++) {      // warm: every copy touched once
        struct ggml_cplan p = ggml_graph_plan(graphs[c], threads, pool);
        p.work_data = work;
        ggml_graph_compute(graphs[c], &p);
    }
    static double seconds[MAX_PASSES];
    double spent = 0;
    int passes = 0;
    while ((passes < 20 || spent < min_seconds) && passes < MAX_PASSES) {
        struct ggml_cplan p = ggml_graph_plan(graphs[passes % copies], threads, pool);
        p.work_data = work;
        double t0 = now();
        ggml_graph_compute(graphs[passes % copies], &p);
        seconds[passes] = now() - t0;
        spent += seconds[passes++];
    }
    qsort(seconds, passes, sizeof(double), by_value);
    printf("%.9f %d\n", seconds[passes / 2], passes);
    ggml_threadpool_free(pool);
    free(work);
    ggml_free(ctx);
    return 0;
}
