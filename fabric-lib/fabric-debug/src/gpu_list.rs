//! GPU lists on the command line: `0`, `0,1`, `3,1` (CUDA ordinals, in the order given). Empty
//! entries, non-numbers and repeated GPUs are refused with a message naming the entry.
use std::fmt;
use std::str::FromStr;

/// CUDA ordinals in command-line order; engine `i` of a run uses GPU `list[i]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuList(pub Vec<u32>);

/// Largest ordinal accepted (a typo like `10000` fails here, not in the driver).
const MAX_ORDINAL: u32 = 1023;

impl FromStr for GpuList {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        if text.trim().is_empty() {
            return Err("the GPU list is empty (expected CUDA ordinals such as 0 or 0,1)".into());
        }
        let mut ordinals = Vec::new();
        for (i, entry) in text.split(',').enumerate() {
            let entry = entry.trim();
            if entry.is_empty() {
                return Err(format!("GPU list '{text}': entry {} is empty (expected e.g. 0,1)", i + 1));
            }
            let ordinal: u32 = entry.parse().map_err(|_| {
                format!("GPU list '{text}': '{entry}' is not a GPU index (expected CUDA ordinals such as 0,1)")
            })?;
            if ordinal > MAX_ORDINAL {
                return Err(format!("GPU list '{text}': GPU {ordinal} is out of range (0..={MAX_ORDINAL})"));
            }
            if ordinals.contains(&ordinal) {
                return Err(format!("GPU list '{text}': GPU {ordinal} is listed twice"));
            }
            ordinals.push(ordinal);
        }
        Ok(GpuList(ordinals))
    }
}

impl fmt::Display for GpuList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self.0.iter().map(u32::to_string).collect();
        f.write_str(&names.join(","))
    }
}

/// Where the buffers of engine `i` live: host memory, or GPU `ordinal`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    Host,
    Gpu(u32),
}

impl Placement {
    /// One placement per engine: one engine in host memory without a list, one per GPU with one.
    pub fn for_run(gpus: Option<&GpuList>) -> Vec<Placement> {
        match gpus {
            None => vec![Placement::Host],
            Some(list) => list.0.iter().map(|&g| Placement::Gpu(g)).collect(),
        }
    }

    /// `host` or `cuda:N`, for reports.
    pub fn name(self) -> String {
        match self {
            Placement::Host => "host".into(),
            Placement::Gpu(g) => format!("cuda:{g}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_lists_keep_their_order() {
        assert_eq!("0".parse::<GpuList>().unwrap().0, vec![0]);
        assert_eq!("0,1".parse::<GpuList>().unwrap().0, vec![0, 1]);
        assert_eq!(" 3, 1 ".parse::<GpuList>().unwrap().0, vec![3, 1]);
        assert_eq!("2,0,1".parse::<GpuList>().unwrap().to_string(), "2,0,1");
    }

    #[test]
    fn bad_lists_say_what_is_wrong() {
        let err = |t: &str| t.parse::<GpuList>().unwrap_err();
        assert!(err("0,,1").contains("entry 2 is empty"), "{}", err("0,,1"));
        assert!(err("0,").contains("entry 2 is empty"));
        assert!(err("x").contains("'x' is not a GPU index"));
        assert!(err("-1").contains("'-1' is not a GPU index"));
        assert!(err("0,1,0").contains("GPU 0 is listed twice"));
        assert!(err("").contains("empty"));
        assert!(err("5000").contains("out of range"));
    }

    #[test]
    fn placements_follow_the_list() {
        assert_eq!(Placement::for_run(None), vec![Placement::Host]);
        let list: GpuList = "1,0".parse().unwrap();
        assert_eq!(Placement::for_run(Some(&list)), vec![Placement::Gpu(1), Placement::Gpu(0)]);
        assert_eq!(Placement::Gpu(1).name(), "cuda:1");
    }
}
