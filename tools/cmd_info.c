/* `moefuse info`: what this build contains and which devices it can reach. */
#include "ceiling.h"
#include "tools.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void help_info(void)
{
    printf("usage: moefuse info\n"
           "\n"
           "Prints the library version, the backends compiled in, for each of them the device\n"
           "a context gets (or why none could be created), and the backend 'auto' picks.\n");
}

int cmd_info(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (is_help(argv[i])) {
            help_info();
            return 0;
        }
        fprintf(stderr, "moefuse info: unknown argument '%s'\n", argv[i]);
        return 2;
    }
    const unsigned v = moefuse_version(); /* the library's, which may not be the header's */
    printf("moefuse %u.%u.%u\n", v / 10000, v / 100 % 100, v % 100);
    const char *built = moefuse_built_backends();
    char list[256];

    /* What `moefuse bench` measures its same-run ceilings with, per built backend. */
    snprintf(list, sizeof list, "%s", built);
    const char *label = "bench ceiling: ";
    for (char *save = NULL, *name = strtok_r(list, ",", &save); name;
         name = strtok_r(NULL, ",", &save)) {
        const ceiling_provider *ceiling = ceiling_provider_for(name);
        printf("%s %s: %s\n", label, name, ceiling ? ceiling->summary : "none in this build");
        label = "               ";
    }
    printf("built backends: %s\n", built);

    /* One context per built backend: its device, or the reason it has none. */
    snprintf(list, sizeof list, "%s", built);
    int failures = 0;
    for (char *save = NULL, *name = strtok_r(list, ",", &save); name;
         name = strtok_r(NULL, ",", &save)) {
        moefuse_context *ctx = NULL;
        moefuse_status st = moefuse_context_create(&ctx, name);
        if (st == MOEFUSE_OK) {
            printf("  %-7s %s\n", name, moefuse_device_name(ctx));
            moefuse_context_destroy(ctx);
        } else {
            /* A backend without a device is information, not a failure of `info`. */
            printf("  %-7s unavailable: %s\n", name, moefuse_last_error(NULL));
        }
    }

    moefuse_context *ctx = NULL;
    if (moefuse_context_create(&ctx, "auto") == MOEFUSE_OK) {
        printf("auto picks:     %s (%s)\n", moefuse_backend_name(ctx), moefuse_device_name(ctx));
        moefuse_context_destroy(ctx);
    } else {
        printf("auto picks:     nothing: %s\n", moefuse_last_error(NULL));
        failures++;
    }
    /* What a program that passes NULL (the usual case) gets. */
    const char *env = getenv("MOEFUSE_BACKEND");
    if (env && *env) {
        if (moefuse_context_create(&ctx, NULL) == MOEFUSE_OK) {
            printf("MOEFUSE_BACKEND=%s -> %s\n", env, moefuse_backend_name(ctx));
            moefuse_context_destroy(ctx);
        } else {
            printf("MOEFUSE_BACKEND=%s -> no context: %s\n", env, moefuse_last_error(NULL));
        }
    } else {
        printf("MOEFUSE_BACKEND unset: programs passing NULL get auto\n");
    }
    return failures == 0 ? 0 : 1;
}
