fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u32 = args[1].parse().unwrap();
    let script: cohort_sim::Script = args[2].parse().unwrap();
    let plan: cohort_sim::FaultPlan = args.get(3).map(|s| s.parse().unwrap()).unwrap_or_default();
    let t = std::time::Instant::now();
    // Optional 4th and 5th arguments: ranks per host, and "lazy" for lazy connection.
    let per_host: u32 = args.get(4).map_or(1, |s| s.parse().unwrap());
    let lazy = args.get(5).is_some_and(|s| s == "lazy");
    let r = cohort_sim::Simulation::new(n)
        .seed(1)
        .script(script)
        .faults(plan)
        .ranks_per_host(per_host)
        .lazy_connect(lazy)
        .run()
        .unwrap();
    println!("{r}");
    eprintln!("wall {:?}", t.elapsed());
}
