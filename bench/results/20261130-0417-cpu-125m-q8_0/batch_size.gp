set terminal pngcairo size 900,620 font 'sans,10'
set output 'bench/results/20261130-0417-cpu-125m-q8_0/batch_size.png'
set grid
set key outside right top
set title 'Intel(R) Xeon(R) Processor (cpu): sequences per engine step, by sweep point'
set xlabel 'point: r = request rate, c = concurrency, s = max\_batch\_seqs, t = batch\_timeout (ms)'
set ylabel 'share of engine steps'
set yrange [0:1]
set y2label 'mean batch size'
set y2range [0:*]
set y2tics
set ytics nomirror
set xtics rotate by -60 font ',8'
set style data histograms
set style histogram rowstacked
set style fill solid 0.9 border -1
set boxwidth 0.75
set key outside right title 'batch size'
plot 'bench/results/20261130-0417-cpu-125m-q8_0/batch_size.dat' using 2:xtic(1) title '1', 'bench/results/20261130-0417-cpu-125m-q8_0/batch_size.dat' using 3 title '2', 'bench/results/20261130-0417-cpu-125m-q8_0/batch_size.dat' using 4 title '3', 'bench/results/20261130-0417-cpu-125m-q8_0/batch_size.dat' using 5 title '4', 'bench/results/20261130-0417-cpu-125m-q8_0/batch_size.dat' using 6 title '5-6', 'bench/results/20261130-0417-cpu-125m-q8_0/batch_size.dat' using 7 title '7-8', 'bench/results/20261130-0417-cpu-125m-q8_0/batch_size.dat' using 8 title '9-12', 'bench/results/20261130-0417-cpu-125m-q8_0/batch_size.dat' using 9 title '13-16', 'bench/results/20261130-0417-cpu-125m-q8_0/batch_size.dat' using 0:10 axes x1y2 with linespoints lc rgb 'black' lw 2 pt 7 title 'mean'
