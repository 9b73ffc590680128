// An emulated NVRTC (libnvrtc.so) beside the emulated driver (driver.cpp):
// the driver runs the kernels compiled into it as C++, so "compiling"
// returns a marker instead of PTX, which the emulated cuModuleLoadData
// accepts and the real one would refuse. The real NVRTC compile of the
// kernels is checked separately (scripts/ci/cuda-build.sh).
#include <cstdlib>
#include <cstring>
#include <string>

namespace {
using nvrtcResult = int;
constexpr nvrtcResult SUCCESS = 0, INVALID_INPUT = 3, INVALID_PROGRAM = 4;
// driver.cpp's NVRTC_MARKER starts this text.
const char PTX[] = "// samplerd emulated NVRTC: no PTX; the emulated driver runs the kernels as C++\n";
struct Program {
    std::string source;
};
}  // namespace

#define API extern "C" __attribute__((visibility("default")))

API nvrtcResult nvrtcVersion(int* major, int* minor) {
    *major = 13;
    *minor = 0;
    return SUCCESS;
}
API const char* nvrtcGetErrorString(nvrtcResult r) {
    switch (r) {
        case SUCCESS: return "NVRTC_SUCCESS";
        case INVALID_INPUT: return "NVRTC_ERROR_INVALID_INPUT";
        case INVALID_PROGRAM: return "NVRTC_ERROR_INVALID_PROGRAM";
        default: return "NVRTC_ERROR (emulated)";
    }
}
API nvrtcResult nvrtcCreateProgram(void** prog, const char* src, const char*, int, const char* const*,
                                   const char* const*) {
    if (!prog || !src) return INVALID_INPUT;
    *prog = new Program{src};
    return SUCCESS;
}
API nvrtcResult nvrtcDestroyProgram(void** prog) {
    if (!prog || !*prog) return INVALID_PROGRAM;
    delete (Program*)*prog;
    *prog = nullptr;
    return SUCCESS;
}
API nvrtcResult nvrtcCompileProgram(void* prog, int, const char* const*) { return prog ? SUCCESS : INVALID_PROGRAM; }
API nvrtcResult nvrtcGetPTXSize(void* prog, size_t* n) {
    if (!prog) return INVALID_PROGRAM;
    *n = sizeof PTX;
    return SUCCESS;
}
API nvrtcResult nvrtcGetPTX(void* prog, char* out) {
    if (!prog) return INVALID_PROGRAM;
    memcpy(out, PTX, sizeof PTX);
    return SUCCESS;
}
API nvrtcResult nvrtcGetProgramLogSize(void* prog, size_t* n) {
    if (!prog) return INVALID_PROGRAM;
    *n = 1;
    return SUCCESS;
}
API nvrtcResult nvrtcGetProgramLog(void* prog, char* out) {
    if (!prog) return INVALID_PROGRAM;
    out[0] = 0;
    return SUCCESS;
}
