//! Host topology: GPUs, NICs, NUMA nodes and CPUs read from sysfs, with an explicit override.
//!
//! GPU ↔ NIC pairing is by PCIe proximity: the NICs whose sysfs device path shares the longest
//! prefix with the GPU's (same switch beats same root complex beats same socket). Worker CPUs are
//! physical cores (the first thread of each SMT sibling set) of the device's NUMA node.
use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// A PCI device found in sysfs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciDevice {
    /// Bus id, e.g. `0000:18:00.0`.
    pub bus_id: String,
    /// Canonical sysfs path (encodes the PCIe hierarchy).
    pub path: PathBuf,
    /// NUMA node, if the kernel reports one.
    pub numa_node: Option<u32>,
}

/// A network interface or RDMA device and the PCI device behind it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Nic {
    /// Interface name (`eth0`) or RDMA device name (`mlx5_0`, `rdmap0s6`).
    pub name: String,
    pub pci: PciDevice,
}

/// One device (a GPU, or the host) with the NICs it should use and the CPUs to pin to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceTopology {
    /// `cuda:N` for GPUs (in PCI bus order), `host` for CPU-only engines.
    pub device: String,
    pub pci: Option<PciDevice>,
    /// Closest NICs (or configured interfaces), in order.
    pub nics: Vec<String>,
    pub numa_node: Option<u32>,
    /// Physical cores of the device's NUMA node (no SMT siblings), for worker pinning.
    pub cpus: Vec<usize>,
}

/// Everything discovered.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topology {
    pub devices: Vec<DeviceTopology>,
    pub nics: Vec<Nic>,
}

fn read_trim(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// Parses a kernel CPU list such as `0-3,8,10-11`.
pub fn parse_cpu_list(text: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                    out.extend(a..=b);
                }
            }
            None => out.extend(part.trim().parse::<usize>().ok()),
        }
    }
    out
}

fn pci_device(root: &Path, device_link: &Path) -> Option<PciDevice> {
    let path = fs::canonicalize(device_link).ok()?;
    let bus_id = path.file_name()?.to_string_lossy().into_owned();
    let numa_node =
        read_trim(&path.join("numa_node")).and_then(|n| n.parse::<i64>().ok()).and_then(|n| u32::try_from(n).ok());
    let _ = root;
    Some(PciDevice { bus_id, path, numa_node })
}

/// Number of leading path components two PCI device paths share.
fn shared_depth(a: &Path, b: &Path) -> usize {
    a.components().zip(b.components()).take_while(|(x, y)| x == y).count()
}

/// Reads the topology below `root` (normally `/`; tests pass a fake tree).
pub fn detect(root: &Path) -> Topology {
    let sys = root.join("sys");
    let mut nics = Vec::new();
    for class in ["class/infiniband", "class/net"] {
        let Ok(entries) = fs::read_dir(sys.join(class)) else { continue };
        let mut names: Vec<_> = entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        for name in names {
            if let Some(pci) = pci_device(root, &sys.join(class).join(&name).join("device")) {
                nics.push(Nic { name, pci });
            }
        }
    }
    let mut gpus: Vec<PciDevice> = Vec::new();
    if let Ok(entries) = fs::read_dir(sys.join("bus/pci/devices")) {
        for e in entries.flatten() {
            let dir = e.path();
            let vendor = read_trim(&dir.join("vendor")).unwrap_or_default();
            let class = read_trim(&dir.join("class")).unwrap_or_default();
            // NVIDIA 3D controller (0x0302xx) or VGA controller (0x0300xx).
            if vendor == "0x10de" && (class.starts_with("0x0302") || class.starts_with("0x0300")) {
                gpus.extend(pci_device(root, &dir));
            }
        }
    }
    gpus.sort_by(|a, b| a.bus_id.cmp(&b.bus_id));
    let cpus_of = |node: Option<u32>| physical_cores(&sys, node);
    let mut devices: Vec<DeviceTopology> = gpus
        .into_iter()
        .enumerate()
        .map(|(i, gpu)| {
            let best = nics.iter().map(|n| shared_depth(&n.pci.path, &gpu.path)).max().unwrap_or(0);
            let close: Vec<String> = nics
                .iter()
                .filter(|n| best > 0 && shared_depth(&n.pci.path, &gpu.path) == best)
                .map(|n| n.name.clone())
                .collect();
            DeviceTopology {
                device: format!("cuda:{i}"),
                numa_node: gpu.numa_node,
                cpus: cpus_of(gpu.numa_node),
                nics: close,
                pci: Some(gpu),
            }
        })
        .collect();
    let host_numa = nics.first().and_then(|n| n.pci.numa_node);
    devices.push(DeviceTopology {
        device: "host".into(),
        pci: None,
        nics: nics.iter().map(|n| n.name.clone()).collect(),
        numa_node: host_numa,
        cpus: cpus_of(host_numa),
    });
    Topology { devices, nics }
}

/// Physical cores (first SMT thread of each core) of `node`, or of all online CPUs.
fn physical_cores(sys: &Path, node: Option<u32>) -> Vec<usize> {
    let list = match node {
        Some(n) => read_trim(&sys.join(format!("devices/system/node/node{n}/cpulist"))),
        None => read_trim(&sys.join("devices/system/cpu/online")),
    };
    let mut seen_siblings = BTreeSet::new();
    let mut out = Vec::new();
    for cpu in parse_cpu_list(&list.unwrap_or_default()) {
        let siblings = read_trim(&sys.join(format!("devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")))
            .map(|s| parse_cpu_list(&s))
            .unwrap_or_else(|| vec![cpu]);
        let first = *siblings.iter().min().unwrap_or(&cpu);
        if seen_siblings.insert(first) && first == cpu {
            out.push(cpu);
        }
    }
    out
}

impl Topology {
    /// Replaces the NICs of each named device with explicitly configured interface names (for
    /// containers and software providers), e.g. `[("host", ["nic0", "nic1"])]`.
    pub fn with_override(mut self, overrides: &[(String, Vec<String>)]) -> Self {
        for (device, nics) in overrides {
            match self.devices.iter_mut().find(|d| &d.device == device) {
                Some(d) => d.nics = nics.clone(),
                None => self.devices.push(DeviceTopology {
                    device: device.clone(),
                    pci: None,
                    nics: nics.clone(),
                    numa_node: None,
                    cpus: Vec::new(),
                }),
            }
        }
        self
    }

    /// The entry for `device` (`cuda:N` or `host`).
    pub fn device(&self, device: &str) -> Option<&DeviceTopology> {
        self.devices.iter().find(|d| d.device == device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn write(path: &Path, text: &str) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    }

    /// Two sockets; GPU0 and mlx5_0 behind one PCIe switch on node 0, GPU1 and mlx5_1 on node 1.
    fn fake_tree() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        let dev = |p: &str| r.join("sys/devices").join(p);
        let gpu0 = dev("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0");
        let nic0 = dev("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0");
        let gpu1 = dev("pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:00.0");
        let nic1 = dev("pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:01.0");
        for (d, node) in [(&gpu0, "0"), (&nic0, "0"), (&gpu1, "1"), (&nic1, "1")] {
            write(&d.join("numa_node"), node);
        }
        for g in [&gpu0, &gpu1] {
            write(&g.join("vendor"), "0x10de");
            write(&g.join("class"), "0x030200");
        }
        fs::create_dir_all(r.join("sys/bus/pci/devices")).unwrap();
        symlink(&gpu1, r.join("sys/bus/pci/devices/0000:82:00.0")).unwrap();
        symlink(&gpu0, r.join("sys/bus/pci/devices/0000:02:00.0")).unwrap();
        for (name, d) in [("mlx5_0", &nic0), ("mlx5_1", &nic1)] {
            fs::create_dir_all(r.join("sys/class/infiniband").join(name)).unwrap();
            symlink(d, r.join("sys/class/infiniband").join(name).join("device")).unwrap();
        }
        write(&r.join("sys/devices/system/node/node0/cpulist"), "0-3,8-11");
        write(&r.join("sys/devices/system/node/node1/cpulist"), "4-7,12-15");
        write(&r.join("sys/devices/system/cpu/online"), "0-15");
        for c in 0..16 {
            let sib = format!("{},{}", c % 8, c % 8 + 8);
            write(&r.join(format!("sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")), &sib);
        }
        t
    }

    #[test]
    fn cpu_lists_parse() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list(""), Vec::<usize>::new());
    }

    #[test]
    fn gpus_pair_with_the_nic_behind_their_switch_and_pin_to_physical_cores() {
        let t = fake_tree();
        let topo = detect(t.path());
        let g0 = topo.device("cuda:0").unwrap();
        let g1 = topo.device("cuda:1").unwrap();
        assert_eq!(g0.nics, vec!["mlx5_0"]);
        assert_eq!(g1.nics, vec!["mlx5_1"]);
        assert_eq!(g0.numa_node, Some(0));
        assert_eq!(g0.cpus, vec![0, 1, 2, 3], "SMT siblings 8-11 are skipped");
        assert_eq!(g1.cpus, vec![4, 5, 6, 7]);
        assert_eq!(topo.device("host").unwrap().nics, vec!["mlx5_0", "mlx5_1"]);
    }

    #[test]
    fn override_replaces_nics() {
        let t = fake_tree();
        let topo = detect(t.path()).with_override(&[("host".into(), vec!["nic0".into(), "nic1".into()])]);
        assert_eq!(topo.device("host").unwrap().nics, vec!["nic0", "nic1"]);
    }

    #[test]
    fn real_machine_detects_without_panicking() {
        let topo = detect(Path::new("/"));
        assert!(topo.device("host").is_some());
        assert!(!topo.device("host").unwrap().cpus.is_empty());
    }
}
