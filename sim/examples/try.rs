fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u32 = args[1].parse().unwrap();
    let script: cohort_sim::Script = args[2].parse().unwrap();
    let plan: cohort_sim::FaultPlan = args.get(3).map(|s| s.parse().unwrap()).unwrap_or_default();
    let t = std::time::Instant::now();
    let r = cohort_sim::Simulation::new(n).seed(1).script(script).faults(plan).run().unwrap();
    println!("{r}");
    eprintln!("wall {:?}", t.elapsed());
}
