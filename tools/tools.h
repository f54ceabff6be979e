/* Shared declarations of the `moefuse` program's subcommands. */
#ifndef MOEFUSE_TOOLS_H
#define MOEFUSE_TOOLS_H

#include <moefuse.h>

int cmd_info(int argc, char **argv);
int cmd_demo(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_prove(int argc, char **argv);

void help_info(void);
void help_demo(void);
void help_bench(void);
void help_prove(void);

/* 1 when argv[i] is -h or --help. */
int is_help(const char *arg);
/* Parse a non-negative 64-bit integer; 0 on success, -1 (with a message) on error. */
int parse_i64(const char *what, const char *text, int64_t *value);
/* Print "moefuse: <what>: <status>: <message>" for a failed call and return 1. */
int report_failure(const moefuse_context *ctx, const char *what, moefuse_status status);

#endif
