//! The CPU features the vectorised paths choose between, detected once per
//! process and cached: every call site asks [`features`] instead of
//! running its own `is_x86_feature_detected!` chain, so all of them agree
//! on which build runs.

use std::sync::OnceLock;

/// The x86_64 features samplerd's kernels use (all false elsewhere).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Features {
    avx2: bool,
    fma: bool,
    popcnt: bool,
    avx512f: bool,
    avx512vl: bool,
    avx512bw: bool,
    avx512dq: bool,
    f16c: bool,
    avx512bf16: bool,
    avx512vnni: bool,
}

/// The instruction-set tier a [`dispatch!`](crate::dispatch) body is compiled for, from the
/// most capable down.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// No AVX2+FMA: the x86_64 baseline (SSE2) or another architecture.
    Baseline,
    /// AVX2 and FMA.
    Avx2Fma,
    /// AVX-512 F, VL, BW and DQ, with AVX2 and FMA.
    Avx512,
}

impl Features {
    /// Asks the CPU (uncached; [`features`] caches it).
    pub fn detect() -> Features {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            Features {
                avx2: has!("avx2"),
                fma: has!("fma"),
                popcnt: has!("popcnt"),
                avx512f: has!("avx512f"),
                avx512vl: has!("avx512vl"),
                avx512bw: has!("avx512bw"),
                avx512dq: has!("avx512dq"),
                f16c: has!("f16c"),
                avx512bf16: has!("avx512bf16"),
                avx512vnni: has!("avx512vnni"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Features::default()
    }

    pub fn avx2(self) -> bool {
        self.avx2
    }

    pub fn fma(self) -> bool {
        self.fma
    }

    pub fn popcnt(self) -> bool {
        self.popcnt
    }

    pub fn avx512f(self) -> bool {
        self.avx512f
    }

    pub fn avx512dq(self) -> bool {
        self.avx512dq
    }

    pub fn avx512vl(self) -> bool {
        self.avx512vl
    }

    /// F16C (`vcvtph2ps`: f16 → f32 in registers).
    pub fn f16c(self) -> bool {
        self.f16c
    }

    /// AVX-512 BF16 (`vdpbf16ps`).
    pub fn avx512bf16(self) -> bool {
        self.avx512bf16
    }

    /// AVX-512 VNNI (`vpdpbusd`).
    pub fn avx512vnni(self) -> bool {
        self.avx512vnni
    }

    /// AVX-512F and POPCNT (the AVX-512 kernels that count mask bits).
    pub fn avx512f_popcnt(self) -> bool {
        self.avx512f && self.popcnt
    }

    /// The tier [`dispatch!`](crate::dispatch) picks.
    pub fn isa(self) -> Isa {
        if self.avx512f && self.avx512vl && self.avx512bw && self.avx512dq && self.avx2 && self.fma
        {
            Isa::Avx512
        } else if self.avx2 && self.fma {
            Isa::Avx2Fma
        } else {
            Isa::Baseline
        }
    }
}

/// This CPU's features, detected on the first call.
#[inline]
pub fn features() -> Features {
    static DETECTED: OnceLock<Features> = OnceLock::new();
    *DETECTED.get_or_init(Features::detect)
}

/// Runs a body compiled for the best [`Isa`] of this CPU: AVX-512 (16
/// lanes in one register), AVX2+FMA, or the baseline. The body must be
/// `#[inline(always)]`, so that each `#[target_feature]` wrapper gets its
/// own copy compiled with those features.
///
/// - `dispatch!(body(a: A, b: B) -> R)` calls `body(a, b)`;
/// - `dispatch!(body::<_, C…>(a: A) -> R)` calls `body::<FMA, C…>(a)` with
///   `FMA = true` in the AVX-512 and AVX2+FMA builds (both have fused
///   multiply-adds, so they give the same bits) and `false` in the
///   baseline.
#[macro_export]
macro_rules! dispatch {
    ($body:ident::<_ $(, $c:tt)*>($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        $crate::dispatch!(@select [$body::<true $(, $c)*>] [$body::<false $(, $c)*>] ($($arg: $ty),*) -> $ret)
    };
    ($body:ident($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        $crate::dispatch!(@select [$body] [$body] ($($arg: $ty),*) -> $ret)
    };
    (@select [$($fast:tt)*] [$($base:tt)*] ($($arg:ident: $ty:ty),*) -> $ret:ty) => {{
        fn select($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
                fn avx512($($arg: $ty),*) -> $ret {
                    $($fast)*($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) -> $ret {
                    $($fast)*($($arg),*)
                }
                match $crate::features().isa() {
                    // SAFETY: `Isa::Avx512` means the CPU has every
                    // feature `avx512` enables.
                    $crate::Isa::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: `Isa::Avx2Fma` means the CPU has AVX2 and FMA.
                    $crate::Isa::Avx2Fma => return unsafe { avx2($($arg),*) },
                    $crate::Isa::Baseline => {}
                }
            }
            $($base)*($($arg),*)
        }
        select($($arg),*)
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_features_are_the_detected_ones() {
        assert_eq!(features(), Features::detect());
        let f = features();
        let isa = f.isa();
        if isa >= Isa::Avx2Fma {
            assert!(f.avx2() && f.fma());
        }
        if isa == Isa::Avx512 {
            assert!(f.avx512f());
        }
    }

    /// Each getter reports its own feature, as the standard library
    /// detects it.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn getters_report_their_own_feature() {
        use std::arch::is_x86_feature_detected as has;
        let f = features();
        let pairs = [
            ("avx2", f.avx2(), has!("avx2")),
            ("fma", f.fma(), has!("fma")),
            ("popcnt", f.popcnt(), has!("popcnt")),
            ("avx512f", f.avx512f(), has!("avx512f")),
            ("avx512vl", f.avx512vl(), has!("avx512vl")),
            ("avx512dq", f.avx512dq(), has!("avx512dq")),
            ("f16c", f.f16c(), has!("f16c")),
            ("avx512bf16", f.avx512bf16(), has!("avx512bf16")),
            ("avx512vnni", f.avx512vnni(), has!("avx512vnni")),
        ];
        for (name, got, want) in pairs {
            assert_eq!(got, want, "{name}");
        }
    }

    #[inline(always)]
    fn fused<const FMA: bool>(a: f32) -> (bool, f32) {
        (
            FMA,
            if FMA {
                a.mul_add(3.0, 1.0)
            } else {
                a * 3.0 + 1.0
            },
        )
    }

    #[test]
    fn dispatch_picks_fma_with_the_tier() {
        let a = 2.0f32;
        let (fma, v) = dispatch!(fused::<_>(a: f32) -> (bool, f32));
        let _ = v;
        assert_eq!(fma, features().isa() >= Isa::Avx2Fma);
    }
}
