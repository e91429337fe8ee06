/*
 * graph.c: libamdhip64.c's stream capture and graph section
 * (hipStreamBeginCapture, hipGraphLaunch, ...), compiled as a translation
 * unit of its own, so that a stand-in built without this file (the HIP
 * tests' partial stand-ins) is a ROCm lacking those calls. Nothing else
 * belongs here.
 */
#define MEMGOV_STANDIN_HIP_SECTION_GRAPHS 1
#include "libamdhip64.c"
