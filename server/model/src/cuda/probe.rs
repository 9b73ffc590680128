//! Probing the CUDA libraries and device 0 without panicking.
//!
//! Probing the CUDA libraries and device 0 without panicking: cudarc's
//! dynamically loaded entry points panic when their library is absent, so
//! the libraries are looked up with `is_culib_present` before any call.

use super::device::{DeviceError, Placement};
use cudarc::driver::{CudaContext, result, sys};

/// True when the driver library can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver's candidate file names; loading
    // libcuda has no initialisation side effects until cuInit is called.
    unsafe { sys::is_culib_present() }
}

/// True when NVRTC can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: as above, a dlopen of NVRTC's candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Device 0, after checking the driver and NVRTC are present and the driver
/// initialises and counts at least one device.
pub fn first_device() -> Result<Placement, DeviceError> {
    if !driver_present() {
        return Err(DeviceError::NoDriver);
    }
    if !nvrtc_present() {
        return Err(DeviceError::NoNvrtc);
    }
    // cuInit fails with CUDA_ERROR_NO_DEVICE (or a driver/kernel-module
    // mismatch) when nothing usable is there.
    if let Err(e) = result::init() {
        return Err(DeviceError::NoDevice {
            detail: format!("cuInit: {e}"),
        });
    }
    let n = result::device::get_count().map_err(|e| DeviceError::Driver(format!("{e}")))?;
    if n < 1 {
        return Err(DeviceError::NoDevice {
            detail: "device count is 0".into(),
        });
    }
    let ctx = CudaContext::new(0).map_err(|e| DeviceError::Driver(format!("device 0: {e}")))?;
    let name = ctx
        .name()
        .map_err(|e| DeviceError::Driver(format!("device 0 name: {e}")))?;
    let compute_capability = ctx
        .compute_capability()
        .map_err(|e| DeviceError::Driver(format!("device 0 compute capability: {e}")))?;
    Ok(Placement::Cuda {
        ordinal: 0,
        name,
        compute_capability,
    })
}
