/* The `moefuse` program: subcommand dispatch, help and small shared helpers. */
#include "tools.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void help_main(void)
{
    printf("usage: moefuse <command> [options]\n"
           "\n"
           "commands:\n"
           "  info    version, built backends, devices, and what 'auto' picks\n"
           "  demo    one MoE layer of Qwen3-30B-A3B, checked against the CPU golden backend\n"
           "  bench   time one operation against a ceiling measured in the same run\n"
           "  prove   every f32 input of the activations, bit for bit against their definition\n"
           "  help    this text; 'moefuse help <command>' or 'moefuse <command> --help'\n"
           "\n"
           "The backend comes from --backend, else MOEFUSE_BACKEND, else auto.\n");
}

int is_help(const char *arg) { return strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0; }

int parse_i64(const char *what, const char *text, int64_t *value)
{
    char *end = NULL;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || v < 0) {
        fprintf(stderr, "moefuse: %s: '%s' is not a non-negative integer\n", what, text);
        return -1;
    }
    *value = (int64_t)v;
    return 0;
}

int report_failure(const moefuse_context *ctx, const char *what, moefuse_status status)
{
    fprintf(stderr, "moefuse: %s failed: %s: %s\n", what, moefuse_status_name(status),
            moefuse_last_error(ctx));
    return 1;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        help_main();
        return 2;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "info") == 0)
        return cmd_info(argc - 1, argv + 1);
    if (strcmp(cmd, "demo") == 0)
        return cmd_demo(argc - 1, argv + 1);
    if (strcmp(cmd, "bench") == 0)
        return cmd_bench(argc - 1, argv + 1);
    if (strcmp(cmd, "prove") == 0)
        return cmd_prove(argc - 1, argv + 1);
    if (strcmp(cmd, "help") == 0 || is_help(cmd)) {
        if (argc > 2 && strcmp(argv[2], "info") == 0)
            help_info();
        else if (argc > 2 && strcmp(argv[2], "demo") == 0)
            help_demo();
        else if (argc > 2 && strcmp(argv[2], "bench") == 0)
            help_bench();
        else if (argc > 2 && strcmp(argv[2], "prove") == 0)
            help_prove();
        else
            help_main();
        return 0;
    }
    if (strcmp(cmd, "--version") == 0 || strcmp(cmd, "version") == 0) {
        const unsigned v = moefuse_version(); /* the library's, which may not be the header's */
        printf("moefuse %u.%u.%u\n", v / 10000, v / 100 % 100, v % 100);
        return 0;
    }
    fprintf(stderr, "moefuse: unknown command '%s'\n\n", cmd);
    help_main();
    return 2;
}
