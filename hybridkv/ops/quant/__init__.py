from hybridkv.ops.quant.reference import (  # noqa: F401
    E2M1_VALUES,
    act_quant_sim,
    dequant_fp4_weight,
    dequant_fp8_weight,
    e2m1_round,
    fp4_round_trip,
    fp8_round_trip,
    pack_fp4,
    pow2_scale,
    quant_fp4,
    quant_fp8_weight,
    unpack_fp4,
)
