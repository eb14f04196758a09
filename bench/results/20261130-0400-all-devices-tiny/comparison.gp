set terminal pngcairo size 1400,560 font 'sans,10'
set output 'bench/results/20261130-0400-all-devices-tiny/comparison.png'
set grid
set key outside right top
set multiplot layout 1,2 title 'p99 latency against output throughput, every device (dots: every sweep point; lines: the best latency reached at each throughput)'
set xlabel 'output tokens/s'
set logscale xy
set key bottom right inside font ',8'
set title 'p99 TTFT'
set ylabel 'p99 TTFT (ms)'
unset arrow
set arrow from graph 0, first 100 to graph 1, first 100 nohead dt 3 lc rgb 'red'
plot 'bench/results/20261130-0400-all-devices-tiny/comparison.dat' index 0 using 1:2 with points pt 7 ps 0.6 lc 1 notitle, 'bench/results/20261130-0400-all-devices-tiny/comparison.dat' index 1 using 1:2 with linespoints pt 7 lw 2 lc 1 title 'vulkan: llvmpipe (LLVM 15.0.6, 256 bits)', 'bench/results/20261130-0400-all-devices-tiny/comparison.dat' index 3 using 1:2 with points pt 7 ps 0.6 lc 2 notitle, 'bench/results/20261130-0400-all-devices-tiny/comparison.dat' index 4 using 1:2 with linespoints pt 7 lw 2 lc 2 title 'opencl: pthread-skylake-avx512-Intel(R) Xeon(R) Processor', 'bench/results/20261130-0400-all-devices-tiny/comparison.dat' index 6 using 1:2 with points pt 7 ps 0.6 lc 3 notitle, 'bench/results/20261130-0400-all-devices-tiny/comparison.dat' index 7 using 1:2 with linespoints pt 7 lw 2 lc 3 title 'cpu: Intel(R) Xeon(R) Processor'
set title 'p99 ITL'
set ylabel 'p99 ITL (ms)'
unset arrow
set arrow from graph 0, first 25 to graph 1, first 25 nohead dt 3 lc rgb 'red'
plot 'bench/results/20261130-0400-all-devices-tiny/comparison.dat' index 0 using 1:3 with points pt 7 ps 0.6 lc 1 notitle, 'bench/results/20261130-0400-all-devices-tiny/comparison.dat' index 2 using 1:2 with linespoints pt 7 lw 2 lc 1 title 'vulkan: llvmpipe (LLVM 15.0.6, 256 bits)', 'bench/results/20261130-0400-all-devices-tiny/comparison.dat' index 3 using 1:3 with points pt 7 ps 0.6 lc 2 notitle, 'bench/results/20261130-0400-all-devices-tiny/comparison.dat' index 5 using 1:2 with linespoints pt 7 lw 2 lc 2 title 'opencl: pthread-skylake-avx512-Intel(R) Xeon(R) Processor', 'bench/results/20261130-0400-all-devices-tiny/comparison.dat' index 6 using 1:3 with points pt 7 ps 0.6 lc 3 notitle, 'bench/results/20261130-0400-all-devices-tiny/comparison.dat' index 8 using 1:2 with linespoints pt 7 lw 2 lc 3 title 'cpu: Intel(R) Xeon(R) Processor'
unset multiplot
