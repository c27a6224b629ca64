// exl3-vllm peer harness: our own minimal pybind11 module over exllamav3's EXL3-linear kernels.
//
// Only declarations are taken from exllamav3's headers (downloaded under .peer/, never tracked); the
// translation units that define these functions are compiled from that download by build_peer.py.
// Also binds our own decode-only microbenchmark kernel (decode_only.cu).
#include <torch/extension.h>
#include <pybind11/pybind11.h>

#include "hgemm.cuh"
#include "quant/pack.cuh"
#include "quant/frac.cuh"
#include "quant/reconstruct.cuh"
#include "quant/hadamard.cuh"
#include "quant/exl3_gemm.cuh"
#include "quant/exl3_gemv.cuh"
#include "quant/exl3_gemv_int8.cuh"
#include "quant/exl3_kernel_map.cuh"
#include "quant/exl3_devctx.cuh"

void peer_decode_only(const at::Tensor& trellis, at::Tensor& out, int64_t cb, int64_t grid);
void peer_decode_dump(const at::Tensor& trellis, at::Tensor& dump, int64_t cb);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.attr("PEER") = "exllamav3 1.6.5 EXL3-linear subset";

    // exllamav3 functions, same names and argument order as its own bindings.cpp
    m.def("exl3_gemm", &exl3_gemm, "exl3_gemm(A, B, C, suh, A_had, svh, force_shape_idx, mcg, mul1, force_num_sms) -> int");
    m.def("exl3_gemv", &exl3_gemv, "exl3_gemv(A, B, C, suh, A_had, svh, mcg, mul1)");
    m.def("reconstruct", &reconstruct, "reconstruct(W_hat_out, trellis, K, mcg, mul1)");
    m.def("reconstruct_slice", &reconstruct_slice, "reconstruct_slice(out, trellis, K, mcg, mul1, n_offset)");
    m.def("reconstruct_had_slice", &reconstruct_had_slice, "reconstruct_had_slice(out, trellis, suh, svh_from_n_offset, K, mcg, mul1, n_offset)");
    m.def("had_r_128", &had_r_128, "had_r_128(input, output, pre_scale, post_scale, scale)");
    m.def("pack_trellis", &pack_trellis, "pack_trellis(packed, unpacked, K)");
    m.def("unpack_trellis", &unpack_trellis, "unpack_trellis(unpacked, packed, K)");
    m.def("pack_trellis_frac", &pack_trellis_frac, "pack_trellis_frac(packed, unpacked, KA, MASK)");
    m.def("unpack_trellis_frac", &unpack_trellis_frac, "unpack_trellis_frac(unpacked, packed, KA, MASK)");
    m.def("hgemm", &hgemm, "hgemm(a, b, c)");
    m.def("hgemm_recon", &hgemm_recon, "hgemm_recon(a, b, c)");
    m.def("hgemm_f16acc_status", &hgemm_f16acc_status, "hgemm_f16acc_status(device)");
    m.def("g_get_cc", &g_get_cc, "g_get_cc(device)");
    m.def("g_get_num_sms", &g_get_num_sms, "g_get_num_sms(device)");
    m.def("g_get_smem_max", &g_get_smem_max, "g_get_smem_max(device)");
    m.def("exl3_gemv_int8_max_k", &exl3_gemv_int8_max_k, "exl3_gemv_int8_max_k(device)");
    m.def("exl3_gemv_int8_enabled", &exl3_gemv_int8_enabled, "exl3_gemv_int8_enabled()");
    m.def("exl3_gemm_num_kernel_shapes", &exl3_gemm_num_kernel_shapes, "exl3_gemm_num_kernel_shapes()");
    m.def("exl3_gemm_shape_compat", &exl3_gemm_shape_compat, "exl3_gemm_shape_compat(shape_idx, m, k, n, bits, half_k)");

    // ours
    m.def("peer_decode_only", &peer_decode_only, "decode-only rate kernel (ours): (trellis, out_f32[grid*256], cb, grid)");
    m.def("peer_decode_dump", &peer_decode_dump, "decode to row-major tiles (ours): (trellis, dump_f16[tiles*256], cb)");
}
